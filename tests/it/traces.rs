//! OpenTelemetry tracing: the rlsd binary exporting to a real OTLP receiver (tonic over
//! `opentelemetry-proto` for gRPC, axum for HTTP/protobuf), with requests over real gRPC that
//! carry the trace context Envoy sends (`traceparent`, B3).

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{Rlsd, command_at};
use common::{descriptor, request};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;
use rlsd::pb::RateLimitServiceClient;
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

const WAIT: Duration = Duration::from_secs(20);

const CONFIG: &str = r#"
domain: traced
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 1
"#;

/// A span as received, with the attributes of the resource it came with.
#[derive(Clone, Debug)]
struct Received {
    resource: Vec<KeyValue>,
    span: Span,
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

impl Collector {
    fn record(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.resource_spans {
            let resource = resource_spans
                .resource
                .map(|resource| resource.attributes)
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        span,
                    });
                }
            }
        }
    }

    /// Waits until a span named `name` in trace `trace_id` has arrived, and returns it.
    async fn wait_for(&self, name: &str, trace_id: &[u8]) -> Received {
        let deadline = Instant::now() + WAIT;
        loop {
            {
                let spans = self.spans.lock().unwrap();
                if let Some(found) = spans.iter().find(|received| {
                    received.span.name == name && received.span.trace_id == trace_id
                }) {
                    return found.clone();
                }
                assert!(
                    Instant::now() < deadline,
                    "no {name} span in trace {} within {WAIT:?}; received: {:#?}",
                    hex(trace_id),
                    *spans
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn in_trace(&self, trace_id: &[u8]) -> Vec<Received> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|received| received.span.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.record(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC receiver.
async fn grpc_receiver(collector: Collector) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

/// An OTLP/HTTP receiver (protobuf bodies posted to `/v1/traces`).
async fn http_receiver(collector: Collector) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| async move {
            match ExportTraceServiceRequest::decode(body) {
                Ok(request) => {
                    collector.record(request);
                    (
                        http::StatusCode::OK,
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
                Err(error) => (
                    http::StatusCode::BAD_REQUEST,
                    [("content-type", "text/plain")],
                    error.to_string().into_bytes(),
                ),
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|attribute| attribute.key == key)
        .and_then(|attribute| attribute.value.as_ref())
        .and_then(|value| match &value.value {
            Some(any_value::Value::StringValue(text)) => Some(text.clone()),
            _ => None,
        })
}

fn int_attribute(attributes: &[KeyValue], key: &str) -> Option<i64> {
    attributes
        .iter()
        .find(|attribute| attribute.key == key)
        .and_then(|attribute| attribute.value.as_ref())
        .and_then(|value| match &value.value {
            Some(any_value::Value::IntValue(number)) => Some(*number),
            _ => None,
        })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).unwrap())
        .collect()
}

fn config_file() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), CONFIG).unwrap();
    file
}

async fn client(rlsd: &Rlsd) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect")
}

/// One `ShouldRateLimit` for `user`, with `headers` as the call's metadata; its overall code.
async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    user: &str,
    headers: &[(&'static str, &str)],
) -> i32 {
    let mut call = tonic::Request::new(request("traced", vec![descriptor(&[("user", user)])]));
    for (name, value) in headers {
        call.metadata_mut().insert(*name, value.parse().unwrap());
    }
    client
        .should_rate_limit(call)
        .await
        .expect("ShouldRateLimit")
        .into_inner()
        .overall_code
}

/// The call's server span, in the caller's trace and under its span, and the store call
/// beneath it.
async fn assert_traced(collector: &Collector, trace_id: &str, parent: &str, verdict: &str) -> Span {
    let trace_id = unhex(trace_id);
    let server = collector.wait_for("ShouldRateLimit", &trace_id).await.span;
    assert_eq!(hex(&server.parent_span_id), parent, "{server:#?}");
    assert_eq!(server.kind, SpanKind::Server as i32);
    assert_eq!(
        string_attribute(&server.attributes, "ratelimit.domain").as_deref(),
        Some("traced")
    );
    assert_eq!(
        string_attribute(&server.attributes, "ratelimit.overall_code").as_deref(),
        Some(verdict)
    );
    let store = collector.wait_for("store.decide", &trace_id).await.span;
    assert_eq!(store.parent_span_id, server.span_id, "{store:#?}");
    assert_eq!(store.kind, SpanKind::Client as i32);
    assert_eq!(
        int_attribute(&store.attributes, "ratelimit.checks"),
        Some(1)
    );
    assert!(store.start_time_unix_nano >= server.start_time_unix_nano);
    assert!(store.end_time_unix_nano <= server.end_time_unix_nano);
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_a_span_under_the_callers_trace_context_with_its_store_call() {
    let collector = Collector::default();
    let addr = grpc_receiver(collector.clone()).await;
    let config = config_file();
    let rlsd = Rlsd::serve_with(
        [
            "--config".into(),
            config.path().as_os_str().to_owned(),
            "--tracing".into(),
            "--tracing-service-name".into(),
            "rlsd-under-test".into(),
            "--otlp-protocol".into(),
            "grpc".into(),
            "--otlp-endpoint".into(),
            format!("http://{addr}").into(),
        ],
        |command| {
            // Batches every 100 ms rather than 5 s, so the test need not wait.
            command.env("OTEL_BSP_SCHEDULE_DELAY", "100");
        },
    );
    let mut client = client(&rlsd).await;

    // W3C trace context, as Envoy sends it with its OpenTelemetry tracer.
    let w3c_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let w3c_parent = "00f067aa0ba902b7";
    let traceparent = format!("00-{w3c_trace}-{w3c_parent}-01");
    assert_eq!(
        call(&mut client, "alice", &[("traceparent", &traceparent)]).await,
        1
    );
    let store = assert_traced(&collector, w3c_trace, w3c_parent, "OK").await;
    assert_eq!(
        string_attribute(&store.attributes, "ratelimit.store").as_deref(),
        Some("memory")
    );
    let received = collector
        .wait_for("ShouldRateLimit", &unhex(w3c_trace))
        .await;
    assert_eq!(
        string_attribute(&received.resource, "service.name").as_deref(),
        Some("rlsd-under-test")
    );

    // B3 in one header (Envoy's Zipkin tracer), on a call the limit denies.
    let b3_trace = "80f198ee56343ba864fe8b2a57d3eff7";
    let b3_parent = "e457b5a2e4d86bd1";
    let b3 = format!("{b3_trace}-{b3_parent}-1");
    assert_eq!(call(&mut client, "alice", &[("b3", &b3)]).await, 2);
    assert_traced(&collector, b3_trace, b3_parent, "OVER_LIMIT").await;

    // B3 in several headers, with a 64-bit trace id (widened, as B3 allows).
    let short_trace = "a3ce929d0e0e4736";
    let multi_parent = "05e3ac9a4f6e3b90";
    let headers = [
        ("x-b3-traceid", short_trace),
        ("x-b3-spanid", multi_parent),
        ("x-b3-sampled", "1"),
    ];
    assert_eq!(call(&mut client, "bob", &headers).await, 1);
    assert_traced(
        &collector,
        &format!("{short_trace:0>32}"),
        multi_parent,
        "OK",
    )
    .await;

    // A caller that decided not to sample: rlsd follows it and exports nothing of that trace.
    let unsampled_trace = "0af7651916cd43dd8448eb211c80319c";
    let unsampled = format!("00-{unsampled_trace}-b7ad6b7169203331-00");
    assert_eq!(
        call(&mut client, "carol", &[("traceparent", &unsampled)]).await,
        1
    );
    // A later sampled call's spans arriving shows the batch holding the unsampled one went out.
    let after_trace = "11111111111111112222222222222222";
    let after = format!("00-{after_trace}-3333333333333333-01");
    assert_eq!(
        call(&mut client, "dave", &[("traceparent", &after)]).await,
        1
    );
    assert_traced(&collector, after_trace, "3333333333333333", "OK").await;
    assert!(
        collector.in_trace(&unhex(unsampled_trace)).is_empty(),
        "an unsampled caller's trace was exported"
    );

    // No context at all: a new trace, rooted at rlsd's span.
    let before = collector.spans.lock().unwrap().len();
    assert_eq!(call(&mut client, "erin", &[]).await, 1);
    let deadline = Instant::now() + WAIT;
    let root = loop {
        let spans = collector.spans.lock().unwrap().clone();
        if let Some(root) = spans[before..]
            .iter()
            .find(|received| received.span.name == "ShouldRateLimit")
        {
            break root.span.clone();
        }
        assert!(Instant::now() < deadline, "no span for an untraced call");
        drop(spans);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(root.parent_span_id.is_empty(), "{root:#?}");
    assert_eq!(root.trace_id.len(), 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_tracing_variables_export_over_http_from_the_redis_store() {
    let collector = Collector::default();
    let addr = http_receiver(collector.clone()).await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("bin")).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_rlsd"), dir.path().join("bin/ratelimit"))
        .unwrap();
    let configs = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&configs).unwrap();
    std::fs::write(configs.join("ratelimit.yaml"), CONFIG).unwrap();

    let mut command = command_at(dir.path().join("bin/ratelimit"));
    command
        .env("RUNTIME_ROOT", dir.path().join("data"))
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("USE_STATSD", "false")
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("DEBUG_HOST", "127.0.0.1")
        .env("DEBUG_PORT", "0")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        // What Envoy Gateway sets when its telemetry names a tracing provider.
        .env("TRACING_ENABLED", "true")
        .env("TRACING_SERVICE_NAME", "envoy-ratelimit")
        .env("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system")
        .env("TRACING_SERVICE_INSTANCE_ID", "ratelimit-0")
        .env("TRACING_SAMPLING_RATE", "1")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"))
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let rlsd = Rlsd::start(command);
    let mut client = client(&rlsd).await;

    let trace = "5b8aa5a2d2c872e8321cf37308d69df2";
    let parent = "051581bf3cb55c13";
    let traceparent = format!("00-{trace}-{parent}-01");
    assert_eq!(
        call(&mut client, "alice", &[("traceparent", &traceparent)]).await,
        1
    );
    let store = assert_traced(&collector, trace, parent, "OK").await;
    assert_eq!(
        string_attribute(&store.attributes, "ratelimit.store").as_deref(),
        Some("redis")
    );
    let received = collector.wait_for("ShouldRateLimit", &unhex(trace)).await;
    for (key, value) in [
        ("service.name", "envoy-ratelimit"),
        ("service.namespace", "envoy-gateway-system"),
        ("service.instance.id", "ratelimit-0"),
    ] {
        assert_eq!(
            string_attribute(&received.resource, key).as_deref(),
            Some(value),
            "{key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_still_buffered_are_exported_on_shutdown() {
    let collector = Collector::default();
    let addr = grpc_receiver(collector.clone()).await;
    let config = config_file();
    let mut rlsd = Rlsd::serve_with(
        [
            "--config".into(),
            config.path().as_os_str().to_owned(),
            "--tracing".into(),
            "--otlp-protocol".into(),
            "grpc".into(),
            "--otlp-endpoint".into(),
            addr.to_string().into(),
        ],
        |command| {
            // No scheduled export within the test: only the shutdown flush can deliver.
            command.env("OTEL_BSP_SCHEDULE_DELAY", "600000");
        },
    );
    let mut client = client(&rlsd).await;
    let trace = "aaaaaaaaaaaaaaaabbbbbbbbbbbbbbbb";
    let traceparent = format!("00-{trace}-cccccccccccccccc-01");
    assert_eq!(
        call(&mut client, "alice", &[("traceparent", &traceparent)]).await,
        1
    );
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        collector.in_trace(&unhex(trace)).is_empty(),
        "exported before shutdown"
    );

    let status = tokio::task::block_in_place(|| rlsd.terminate(WAIT));
    assert!(status.success(), "{status}\n{}", rlsd.log());
    assert_traced(&collector, trace, "cccccccccccccccc", "OK").await;
}
