use tonic::metadata::MetadataMap;

use super::*;

fn metadata(pairs: &[(&'static str, &'static str)]) -> MetadataMap {
    let mut map = MetadataMap::new();
    for (key, value) in pairs {
        map.insert(*key, value.parse().expect("ascii"));
    }
    map
}

fn parent(pairs: &[(&'static str, &'static str)]) -> SpanContext {
    parent_context(&metadata(pairs))
        .span()
        .span_context()
        .clone()
}

#[test]
fn traceparent_is_the_parent() {
    let context = parent(&[(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )]);
    assert_eq!(
        context.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
    assert!(context.is_sampled() && context.is_remote());
}

#[test]
fn b3_single_and_multi_headers_are_read_and_short_trace_ids_widened() {
    let single = parent(&[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-0")]);
    assert_eq!(
        single.trace_id().to_string(),
        "80f198ee56343ba864fe8b2a57d3eff7"
    );
    assert!(!single.is_sampled());
    let multi = parent(&[
        ("x-b3-traceid", "a3ce929d0e0e4736"),
        ("x-b3-spanid", "00f067aa0ba902b7"),
        ("x-b3-sampled", "1"),
    ]);
    assert_eq!(
        multi.trace_id().to_string(),
        "0000000000000000a3ce929d0e0e4736"
    );
    assert_eq!(multi.span_id().to_string(), "00f067aa0ba902b7");
    assert!(multi.is_sampled());
    let debug = parent(&[
        ("x-b3-traceid", "a3ce929d0e0e4736"),
        ("x-b3-spanid", "00f067aa0ba902b7"),
        ("x-b3-sampled", "0"),
        ("x-b3-flags", "1"),
    ]);
    assert!(debug.is_sampled());
}

#[test]
fn malformed_contexts_start_a_new_trace() {
    for pairs in [
        &[("traceparent", "00-zz-00f067aa0ba902b7-01")][..],
        &[("b3", "not-a-context")],
        &[("b3", "00000000000000000000000000000000-00f067aa0ba902b7")],
        &[("x-b3-traceid", "a3ce929d0e0e4736")],
        &[
            ("x-b3-traceid", "a3ce9"),
            ("x-b3-spanid", "00f067aa0ba902b7"),
        ],
    ] {
        assert!(!parent(pairs).is_valid(), "{pairs:?}");
    }
}

#[test]
fn endpoints_follow_the_otlp_conventions() {
    let settings = |endpoint: Option<&str>, protocol| TracingSettings {
        service_name: "RateLimit".into(),
        service_namespace: String::new(),
        service_instance_id: String::new(),
        sampling_rate: 1.0,
        endpoint: endpoint.map(str::to_owned),
        protocol,
    };
    for (endpoint, protocol, want) in [
        (None, OtlpProtocol::Http, "http://localhost:4318/v1/traces"),
        (None, OtlpProtocol::Grpc, "http://localhost:4317"),
        (
            Some("http://collector:4318/"),
            OtlpProtocol::Http,
            "http://collector:4318/v1/traces",
        ),
        (
            Some("https://c/v1/traces"),
            OtlpProtocol::Http,
            "https://c/v1/traces",
        ),
        (
            Some("127.0.0.1:26000"),
            OtlpProtocol::Grpc,
            "http://127.0.0.1:26000",
        ),
    ] {
        assert_eq!(endpoint_url(&settings(endpoint, protocol)), want);
    }
}

#[tokio::test]
async fn a_sampling_rate_outside_0_to_1_is_refused() {
    let settings = TracingSettings {
        service_name: "RateLimit".into(),
        service_namespace: String::new(),
        service_instance_id: String::new(),
        sampling_rate: 1.5,
        endpoint: None,
        protocol: OtlpProtocol::Grpc,
    };
    let error = Telemetry::start(&settings).err().expect("refused");
    assert_eq!(
        error.to_string(),
        "tracing sampling rate 1.5 is not between 0 and 1"
    );
}
