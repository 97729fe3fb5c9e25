//! Config from an xDS management server, as Envoy Gateway delivers it to envoyproxy/ratelimit:
//! a state-of-the-world ADS stream of `RateLimitConfig` resources, one per domain.
//!
//! Each response is rendered into the YAML a file would hold and validated by the same loader,
//! so a pushed set is accepted or refused exactly as files are. An accepted set replaces the
//! whole config in one swap and is ACKed; a refused one is NACKed with the loader's errors and
//! the last good config keeps serving. The stream reconnects by itself and re-subscribes with
//! the last ACKed version.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{MetadataKey, MetadataValue};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::config::{self, Config};
use crate::metrics::Metrics;
use crate::pb::envoy::config::core::v3::Node;
use crate::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::pb::google::rpc::Status;
use crate::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

/// The resource type rlsd subscribes to, as envoyproxy/ratelimit does.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Default largest response accepted: a config is kilobytes, so anything near this is a broken
/// server.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// How long one connection attempt may take before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings that find a management server that vanished without closing the connection.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// `google.rpc.Code.INVALID_ARGUMENT`, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;

/// Where and how to reach the management server.
#[derive(Clone, Debug)]
pub struct XdsSettings {
    /// `host:port`, `http://host:port` or `https://host:port` (TLS).
    pub server: String,
    /// `node.id` of every request.
    pub node_id: String,
    /// `node.metadata`, as string values.
    pub node_metadata: Vec<(String, String)>,
    /// Wait between a lost stream and the next attempt; doubled for each further loss in a row.
    pub retry_interval: Duration,
    /// The longest wait between attempts.
    pub retry_max: Duration,
    /// Each wait is drawn from `wait * (1 ± retry_jitter)`.
    pub retry_jitter: f64,
    /// Extra gRPC metadata sent with the stream.
    pub headers: Vec<(String, String)>,
    /// TLS to the server; `None` for plaintext (unless the URL is `https://`).
    pub tls: Option<XdsTls>,
    /// Largest response accepted, in bytes; a larger one fails the stream.
    pub max_response_bytes: usize,
    /// Resources naming the same domain are merged into it (`--merge-domain-config`).
    pub merge_domains: bool,
}

/// TLS to the management server.
#[derive(Clone, Debug, Default)]
pub struct XdsTls {
    /// PEM CA certificates that sign the server's certificate (default: the public roots).
    pub ca: Option<PathBuf>,
    /// A PEM client certificate, for servers that require mutual TLS.
    pub cert: Option<PathBuf>,
    /// The client certificate's PEM key.
    pub key: Option<PathBuf>,
    /// The name the server's certificate must carry (default: the URL's host).
    pub san: Option<String>,
}

/// The wait before the next stream after `losses` streams in a row that brought no response:
/// the retry interval (at least [`MIN_RETRY`]), doubled per further loss, spread by `draw`
/// (from 0 to 1) over `wait * (1 ± jitter)` so that replicas that lost the same server do not
/// redial in step, and never more than the ceiling.
fn backoff(settings: &XdsSettings, losses: u32, draw: f64) -> Duration {
    let interval = settings.retry_interval.max(MIN_RETRY);
    let ceiling = settings.retry_max.max(interval);
    let doublings = losses.saturating_sub(1).min(31);
    let base = interval.saturating_mul(1 << doublings).min(ceiling);
    let jitter = settings.retry_jitter.clamp(0.0, 1.0);
    let spread = base.mul_f64(1.0 + jitter * (2.0 * draw.clamp(0.0, 1.0) - 1.0));
    spread.clamp(MIN_RETRY, ceiling)
}

/// The shortest wait between attempts, so that a zero interval cannot spin.
const MIN_RETRY: Duration = Duration::from_millis(10);

/// Why the client cannot be set up or a stream ended.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// A setting is unusable (address, header, TLS files).
    #[error("{0}")]
    Settings(String),
    /// The server could not be reached.
    #[error("connecting to {server}: {reason}")]
    Connect {
        /// The server as configured.
        server: String,
        /// What failed, with its causes.
        reason: String,
    },
    /// The stream failed or was refused.
    #[error("stream: {0}")]
    Stream(#[from] tonic::Status),
    /// The client ended before any config arrived.
    #[error("the xDS client stopped before the first config arrived")]
    Stopped,
}

/// Parses `k1:v1,k2=v2` pairs (either separator, as envoyproxy/ratelimit's variables use).
///
/// # Errors
/// A pair without a separator or with an empty key.
pub fn parse_pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let at = pair
                .find([':', '='])
                .ok_or_else(|| format!("'{pair}' is not key:value or key=value"))?;
            let (key, value) = (pair[..at].trim(), pair[at + 1..].trim());
            if key.is_empty() {
                return Err(format!("'{pair}' has no key"));
            }
            Ok((key.to_owned(), value.to_owned()))
        })
        .collect()
}

/// The xDS config client: run it, and read what it applied from the receiver it came with.
pub struct XdsClient {
    settings: XdsSettings,
    endpoint: Endpoint,
    headers: Vec<(
        MetadataKey<tonic::metadata::Ascii>,
        MetadataValue<tonic::metadata::Ascii>,
    )>,
    config: Arc<ArcSwap<Config>>,
    metrics: Arc<Metrics>,
    applied: watch::Sender<Option<String>>,
}

impl XdsClient {
    /// A client that swaps accepted configs into `config`; the receiver sees each applied
    /// version (`None` until the first).
    ///
    /// # Errors
    /// Unusable settings: a bad address or header, unreadable TLS files.
    pub fn new(
        settings: XdsSettings,
        config: Arc<ArcSwap<Config>>,
        metrics: Arc<Metrics>,
    ) -> Result<(XdsClient, watch::Receiver<Option<String>>), XdsError> {
        let endpoint = endpoint(&settings)?;
        let headers = settings
            .headers
            .iter()
            .map(|(key, value)| {
                let bad = |what: &str| XdsError::Settings(format!("xDS header '{key}': {what}"));
                Ok((
                    MetadataKey::from_bytes(key.to_ascii_lowercase().as_bytes())
                        .map_err(|_| bad("not a valid header name"))?,
                    MetadataValue::try_from(value.as_str())
                        .map_err(|_| bad("not a valid header value"))?,
                ))
            })
            .collect::<Result<_, XdsError>>()?;
        let (applied, receiver) = watch::channel(None);
        let client = XdsClient {
            settings,
            endpoint,
            headers,
            config,
            metrics,
            applied,
        };
        Ok((client, receiver))
    }

    /// Starts a client on this runtime and, unless `force_start`, waits for the first config
    /// it accepts.
    ///
    /// # Errors
    /// Unusable settings (as [`XdsClient::new`]).
    pub async fn start(
        settings: XdsSettings,
        force_start: bool,
        config: Arc<ArcSwap<Config>>,
        metrics: Arc<Metrics>,
    ) -> Result<(), XdsError> {
        let server = settings.server.clone();
        let (client, mut applied) = XdsClient::new(settings, config, metrics)?;
        tokio::spawn(client.run());
        if force_start {
            tracing::info!(%server, "starting before any config arrives over xDS: every domain is unknown until then");
            return Ok(());
        }
        tracing::info!(%server, "waiting for the first config over xDS");
        applied
            .wait_for(Option::is_some)
            .await
            .map_err(|_| XdsError::Stopped)?;
        Ok(())
    }

    /// Streams config until the process ends, reconnecting after each loss.
    pub async fn run(self) {
        let mut acked = String::new();
        // Losses in a row; a stream that delivered a response starts the count again.
        let mut losses: u32 = 0;
        let spread = foldhash::fast::RandomState::default();
        loop {
            let mut answered = false;
            match self.session(&mut acked, &mut answered).await {
                Ok(()) => {
                    tracing::warn!(server = %self.settings.server, "xDS stream closed by the server")
                }
                Err(error) => {
                    tracing::warn!(server = %self.settings.server, %error, "xDS stream lost")
                }
            }
            losses = if answered {
                0
            } else {
                losses.saturating_add(1)
            };
            let draw =
                std::hash::BuildHasher::hash_one(&spread, (losses, std::time::SystemTime::now()));
            let wait = backoff(&self.settings, losses, draw as f64 / u64::MAX as f64);
            tracing::info!(server = %self.settings.server, wait_ms = wait.as_millis(), "xDS reconnect");
            tokio::time::sleep(wait).await;
        }
    }

    /// One stream: subscribe with the last ACKed version, then answer every response.
    async fn session(&self, acked: &mut String, answered: &mut bool) -> Result<(), XdsError> {
        let channel = self
            .endpoint
            .connect()
            .await
            .map_err(|error| XdsError::Connect {
                server: self.settings.server.clone(),
                reason: causes(&error),
            })?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(self.settings.max_response_bytes);
        let (requests, outgoing) = mpsc::channel(4);
        // The channel has room: the first send never waits.
        let _ = requests.try_send(self.request(acked, String::new(), None));
        let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
        for (key, value) in &self.headers {
            request.metadata_mut().insert(key.clone(), value.clone());
        }
        let mut responses = client
            .stream_aggregated_resources(request)
            .await?
            .into_inner();
        tracing::info!(server = %self.settings.server, version = %acked, "xDS stream open");
        while let Some(response) = responses.message().await? {
            *answered = true;
            let reply = match self.apply(&response) {
                Ok(()) => {
                    acked.clone_from(&response.version_info);
                    self.request(acked, response.nonce, None)
                }
                Err(reason) => {
                    self.metrics.config_load_error.inc();
                    tracing::error!(version = %response.version_info, %reason, "xDS config refused (NACK), keeping the last good config");
                    self.request(acked, response.nonce, Some(reason))
                }
            };
            if requests.send(reply).await.is_err() {
                break;
            }
        }
        Ok(())
    }

    fn request(&self, version: &str, nonce: String, error: Option<String>) -> DiscoveryRequest {
        let metadata = (!self.settings.node_metadata.is_empty()).then(|| prost_types::Struct {
            fields: self
                .settings
                .node_metadata
                .iter()
                .map(|(key, value)| {
                    let value = prost_types::Value {
                        kind: Some(prost_types::value::Kind::StringValue(value.clone())),
                    };
                    (key.clone(), value)
                })
                .collect(),
        });
        DiscoveryRequest {
            version_info: version.to_owned(),
            node: Some(Node {
                id: self.settings.node_id.clone(),
                metadata,
                user_agent_name: "rlsd".to_owned(),
                ..Node::default()
            }),
            resource_names: Vec::new(),
            type_url: TYPE_URL.to_owned(),
            response_nonce: nonce,
            error_detail: error.map(|message| Status {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            }),
        }
    }

    /// Validates a response's resources and swaps them in, or says why not.
    fn apply(&self, response: &DiscoveryResponse) -> Result<(), String> {
        let config = load_response(
            response,
            config::LoadOptions {
                merge_domains: self.settings.merge_domains,
                ..config::LoadOptions::default()
            },
        )?;
        let domains = config.domains.len();
        tracing::info!(version = %response.version_info, domains, "config applied from xDS");
        for domain in config.domains.values() {
            tracing::info!(domain = %domain.name, source = %domain.source, "xDS domain");
        }
        for line in crate::admin::describe(&config).lines() {
            tracing::debug!(limit = line, "xDS limit");
        }
        self.config.store(Arc::new(config));
        self.metrics.config_load_success.inc();
        self.applied
            .send_replace(Some(response.version_info.clone()));
        Ok(())
    }
}

/// The config a response describes, validated as files are; the reason for a NACK otherwise.
///
/// # Errors
/// A wrong type URL, an undecodable resource, or the loader's errors, named by resource.
pub fn load_response(
    response: &DiscoveryResponse,
    options: config::LoadOptions,
) -> Result<Config, String> {
    if response.type_url != TYPE_URL {
        return Err(format!(
            "type URL '{}' is not the one rlsd subscribes to ({TYPE_URL})",
            response.type_url
        ));
    }
    let mut sources = Vec::with_capacity(response.resources.len());
    for (index, resource) in response.resources.iter().enumerate() {
        if resource.type_url != TYPE_URL {
            return Err(format!(
                "resource {index}: type URL '{}' is not {TYPE_URL}",
                resource.type_url
            ));
        }
        let decoded = RateLimitConfig::decode(resource.value.as_slice())
            .map_err(|error| format!("resource {index}: not a RateLimitConfig: {error}"))?;
        let name = if decoded.name.is_empty() {
            &decoded.domain
        } else {
            &decoded.name
        };
        sources.push((format!("xds:{name}"), Ok(render_yaml(&decoded))));
    }
    let mut config = config::load_sources(sources, options).map_err(|errors| errors.to_string())?;
    for domain in config.domains.values_mut() {
        domain.source = format!("{} version {}", domain.source, response.version_info);
    }
    Ok(config)
}

/// The YAML file a resource stands for, in envoyproxy/ratelimit's file format.
pub fn render_yaml(resource: &RateLimitConfig) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "domain: {}", quoted(&resource.domain));
    if !resource.descriptors.is_empty() {
        out.push_str("descriptors:\n");
        for descriptor in &resource.descriptors {
            render_descriptor(descriptor, 1, &mut out);
        }
    }
    out
}

fn render_descriptor(descriptor: &RateLimitDescriptor, depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    let _ = writeln!(out, "{pad}- key: {}", quoted(&descriptor.key));
    let field = format!("{pad}  ");
    if !descriptor.value.is_empty() {
        let _ = writeln!(out, "{field}value: {}", quoted(&descriptor.value));
    }
    if let Some(policy) = &descriptor.rate_limit {
        render_policy(policy, &field, out);
    }
    for (flag, on) in [
        ("shadow_mode", descriptor.shadow_mode),
        ("detailed_metric", descriptor.detailed_metric),
        ("quota_mode", descriptor.quota_mode),
    ] {
        if on {
            let _ = writeln!(out, "{field}{flag}: true");
        }
    }
    if let Some(metadata) = &descriptor.metadata {
        let _ = writeln!(out, "{field}metadata: {}", json_struct(&metadata.fields));
    }
    if !descriptor.descriptors.is_empty() {
        let _ = writeln!(out, "{field}descriptors:");
        for child in &descriptor.descriptors {
            render_descriptor(child, depth + 2, out);
        }
    }
}

fn render_policy(policy: &RateLimitPolicy, field: &str, out: &mut String) {
    let _ = writeln!(out, "{field}rate_limit:");
    let unit = RateLimitUnit::try_from(policy.unit).map_or("UNKNOWN", |unit| unit.as_str_name());
    let _ = writeln!(out, "{field}  unit: {unit}");
    let _ = writeln!(
        out,
        "{field}  requests_per_unit: {}",
        policy.requests_per_unit
    );
    if policy.unlimited {
        let _ = writeln!(out, "{field}  unlimited: true");
    }
    if !policy.name.is_empty() {
        let _ = writeln!(out, "{field}  name: {}", quoted(&policy.name));
    }
    if !policy.replaces.is_empty() {
        let _ = writeln!(out, "{field}  replaces:");
        for replace in &policy.replaces {
            let _ = writeln!(out, "{field}    - name: {}", quoted(&replace.name));
        }
    }
}

/// A YAML double-quoted scalar (JSON escaping is valid YAML).
fn quoted(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}

/// A Struct as a JSON object, which YAML reads as a flow mapping.
fn json_struct(fields: &BTreeMap<String, prost_types::Value>) -> String {
    serde_json::Value::Object(
        fields
            .iter()
            .map(|(key, value)| (key.clone(), json_value(value)))
            .collect(),
    )
    .to_string()
}

fn json_value(value: &prost_types::Value) -> serde_json::Value {
    use prost_types::value::Kind;
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(flag)) => serde_json::Value::Bool(*flag),
        Some(Kind::NumberValue(number)) => serde_json::Number::from_f64(*number)
            .map_or(serde_json::Value::Null, serde_json::Value::Number),
        Some(Kind::StringValue(text)) => serde_json::Value::String(text.clone()),
        Some(Kind::ListValue(list)) => {
            serde_json::Value::Array(list.values.iter().map(json_value).collect())
        }
        Some(Kind::StructValue(inner)) => serde_json::Value::Object(
            inner
                .fields
                .iter()
                .map(|(key, value)| (key.clone(), json_value(value)))
                .collect(),
        ),
    }
}

/// An error and its sources, `: `-joined (tonic's transport error alone says only "transport error").
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

/// The endpoint for the server URL, with TLS when asked for.
fn endpoint(settings: &XdsSettings) -> Result<Endpoint, XdsError> {
    let server = settings.server.trim();
    let tls_by_scheme = server.starts_with("https://");
    let uri = if server.contains("://") {
        server.to_owned()
    } else if settings.tls.is_some() {
        format!("https://{server}")
    } else {
        format!("http://{server}")
    };
    let bad = |why: String| XdsError::Settings(format!("xDS server '{server}': {why}"));
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|error| bad(error.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_while_idle(true);
    if settings.tls.is_some() || tls_by_scheme {
        let tls = settings.tls.clone().unwrap_or_default();
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|error| bad(format!("reading {}: {error}", path.display())))
        };
        let mut config = ClientTlsConfig::new();
        config = match &tls.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => config.with_webpki_roots(),
        };
        match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => {
                config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            (None, None) => {}
            _ => {
                return Err(bad(
                    "a client certificate needs both its cert and key".into()
                ));
            }
        }
        if let Some(san) = &tls.san {
            config = config.domain_name(san.clone());
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|error| bad(error.to_string()))?;
    }
    Ok(endpoint)
}

#[cfg(test)]
mod tests;
