//! OpenTelemetry tracing: one server span per `ShouldRateLimit`, a child of the trace context
//! Envoy sends in the call's metadata (W3C `traceparent`, else B3), with the store call as its
//! child span, exported over OTLP (gRPC or HTTP/protobuf) in batches off the request path.

use std::borrow::Cow;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::runtime::Tokio;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use tonic::metadata::MetadataMap;

mod b3;

#[cfg(test)]
mod tests;

/// How spans are sent to the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// OTLP over gRPC (default port 4317).
    Grpc,
    /// OTLP over HTTP with protobuf bodies, to `<endpoint>/v1/traces` (default port 4318).
    Http,
}

/// What `rlsd serve --tracing` was given.
#[derive(Clone, Debug)]
pub struct TracingSettings {
    /// `service.name` of the exported resource.
    pub service_name: String,
    /// `service.namespace`, when not empty.
    pub service_namespace: String,
    /// `service.instance.id`, when not empty.
    pub service_instance_id: String,
    /// Share of new traces sampled (0 to 1); a sampled or unsampled parent decides for itself.
    pub sampling_rate: f64,
    /// The collector: a URL, or `host:port` (then `http://` is assumed); `None`: the default
    /// local collector of the protocol.
    pub endpoint: Option<String>,
    /// gRPC or HTTP.
    pub protocol: OtlpProtocol,
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The sampling rate is not within 0 to 1.
    #[error("tracing sampling rate {0} is not between 0 and 1")]
    SamplingRate(f64),
    /// The exporter rejected its configuration (for example the endpoint).
    #[error("OTLP exporter for {endpoint}: {source}")]
    Exporter {
        /// The endpoint it was given.
        endpoint: String,
        /// The exporter's reason.
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// A running exporter and the tracer requests are traced with.
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: RequestTracer,
}

impl Telemetry {
    /// Builds the exporter; must run inside the Tokio runtime, which carries the batches.
    pub fn start(settings: &TracingSettings) -> Result<Telemetry, TelemetryError> {
        if !(0.0..=1.0).contains(&settings.sampling_rate) {
            return Err(TelemetryError::SamplingRate(settings.sampling_rate));
        }
        let endpoint = endpoint_url(settings);
        let exporter = match settings.protocol {
            OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .with_timeout(Duration::from_secs(5))
                .build(),
            OtlpProtocol::Http => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(endpoint.clone())
                .with_timeout(Duration::from_secs(5))
                .with_headers(Default::default())
                .build(),
        }
        .map_err(|source| TelemetryError::Exporter {
            endpoint: endpoint.clone(),
            source,
        })?;
        let mut attributes = Vec::new();
        for (key, value) in [
            ("service.namespace", &settings.service_namespace),
            ("service.instance.id", &settings.service_instance_id),
        ] {
            if !value.is_empty() {
                attributes.push(KeyValue::new(key, value.clone()));
            }
        }
        let resource = Resource::builder_empty()
            .with_service_name(settings.service_name.clone())
            .with_attributes(attributes)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter, Tokio).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sampling_rate,
            ))))
            .with_resource(resource)
            .build();
        tracing::info!(%endpoint, protocol = ?settings.protocol, rate = settings.sampling_rate, "tracing to OTLP");
        let tracer = RequestTracer {
            tracer: provider.tracer("rlsd"),
        };
        Ok(Telemetry { provider, tracer })
    }

    /// The tracer to give the service.
    pub fn tracer(&self) -> RequestTracer {
        self.tracer.clone()
    }

    /// Exports what is still buffered and stops; off the async threads, since it blocks.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(error)) = flushed {
            tracing::warn!(%error, "tracing: last spans not exported");
        }
    }
}

/// The collector URL the exporter is given.
fn endpoint_url(settings: &TracingSettings) -> String {
    let (default, path) = match settings.protocol {
        OtlpProtocol::Grpc => ("http://localhost:4317", ""),
        OtlpProtocol::Http => ("http://localhost:4318", "/v1/traces"),
    };
    let base = match settings.endpoint.as_deref().map(str::trim) {
        None | Some("") => Cow::Borrowed(default),
        Some(url) if url.contains("://") => Cow::Borrowed(url),
        Some(host_port) => Cow::Owned(format!("http://{host_port}")),
    };
    // As OTEL_EXPORTER_OTLP_ENDPOINT is read by other SDKs: the base, with the signal's path.
    let base = base.trim_end_matches('/');
    if base.ends_with(path) {
        base.to_owned()
    } else {
        format!("{base}{path}")
    }
}

/// Starts request spans; cheap to clone.
#[derive(Clone)]
pub struct RequestTracer {
    tracer: SdkTracer,
}

impl RequestTracer {
    /// The server span of one call, child of the context in `metadata`, as a context to run the
    /// call in.
    pub fn request_span(&self, metadata: &MetadataMap, domain: &str) -> Context {
        let parent = parent_context(metadata);
        let span = self
            .tracer
            .span_builder("ShouldRateLimit")
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
                KeyValue::new("rpc.method", "ShouldRateLimit"),
                KeyValue::new("ratelimit.domain", domain.to_owned()),
            ])
            .start_with_context(&self.tracer, &parent);
        parent.with_span(span)
    }

    /// A child span of `parent` around one store call.
    pub fn store_span(&self, parent: &Context, store: &'static str, checks: usize) -> Context {
        let span = self
            .tracer
            .span_builder("store.decide")
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("ratelimit.store", store),
                KeyValue::new("ratelimit.checks", checks as i64),
            ])
            .start_with_context(&self.tracer, parent);
        parent.with_span(span)
    }
}

/// The caller's trace context: W3C `traceparent` if valid, else B3 (single or multi header),
/// else none (a new trace).
fn parent_context(metadata: &MetadataMap) -> Context {
    let carrier = Metadata(metadata);
    let w3c = TraceContextPropagator::new().extract(&carrier);
    if w3c.span().span_context().is_valid() {
        return w3c;
    }
    match b3::extract(&carrier) {
        Some(remote) => Context::new().with_remote_span_context(remote),
        None => Context::new(),
    }
}

/// gRPC metadata read as a propagation carrier.
struct Metadata<'m>(&'m MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// A remote span context from hex ids (64-bit trace ids are widened, as B3 allows).
fn remote_span_context(trace_id: &str, span_id: &str, sampled: bool) -> Option<SpanContext> {
    let trace_id = match trace_id.len() {
        16 => TraceId::from_hex(&format!("{trace_id:0>32}")).ok()?,
        32 => TraceId::from_hex(trace_id).ok()?,
        _ => return None,
    };
    let span_id = (span_id.len() == 16)
        .then(|| SpanId::from_hex(span_id).ok())
        .flatten()?;
    let flags = if sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let context = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    context.is_valid().then_some(context)
}
