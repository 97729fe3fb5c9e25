//! Proto3 JSON for the admin `/json` endpoint: a `RateLimitRequest` in, a `RateLimitResponse`
//! out, as envoyproxy/ratelimit's `/json` speaks it. Field names are accepted in both the proto
//! (`hits_addend`) and the JSON (`hitsAddend`) spelling; answers use the JSON spelling.

use serde_json::{Map, Value, json};

use crate::pb;
use crate::pb::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::pb::rate_limit_response::{Code, rate_limit::Unit as WireUnit};

/// Parses a proto3-JSON `RateLimitRequest`.
///
/// # Errors
/// A message naming the first field that is not what proto3 JSON allows.
pub fn parse_request(body: &[u8]) -> Result<pb::RateLimitRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|error| format!("invalid JSON: {error}"))?;
    let object = as_object(&value, "request")?;
    let mut request = pb::RateLimitRequest::default();
    for (name, field) in object {
        match name.as_str() {
            "domain" => request.domain = as_str(field, "domain")?.to_owned(),
            "descriptors" => {
                for (i, descriptor) in as_array(field, "descriptors")?.iter().enumerate() {
                    request.descriptors.push(parse_descriptor(descriptor, i)?);
                }
            }
            "hits_addend" | "hitsAddend" => {
                request.hits_addend = u32::try_from(as_u64(field, "hits_addend")?)
                    .map_err(|_| "hits_addend is out of range".to_owned())?;
            }
            other => return Err(format!("unknown field '{other}' in request")),
        }
    }
    Ok(request)
}

fn parse_descriptor(value: &Value, index: usize) -> Result<pb::RateLimitDescriptor, String> {
    let what = format!("descriptors[{index}]");
    let mut descriptor = pb::RateLimitDescriptor::default();
    for (name, field) in as_object(value, &what)? {
        match name.as_str() {
            "entries" => {
                for entry in as_array(field, "entries")? {
                    let entry = as_object(entry, "entry")?;
                    let mut parsed = Entry::default();
                    for (name, field) in entry {
                        match name.as_str() {
                            "key" => parsed.key = as_str(field, "key")?.to_owned(),
                            "value" => parsed.value = as_str(field, "value")?.to_owned(),
                            other => {
                                return Err(format!("unknown field '{other}' in {what} entry"));
                            }
                        }
                    }
                    descriptor.entries.push(parsed);
                }
            }
            "limit" => {
                let mut limit = RateLimitOverride::default();
                for (name, field) in as_object(field, "limit")? {
                    match name.as_str() {
                        "requests_per_unit" | "requestsPerUnit" => {
                            limit.requests_per_unit =
                                u32::try_from(as_u64(field, "requests_per_unit")?)
                                    .map_err(|_| "requests_per_unit is out of range".to_owned())?;
                        }
                        "unit" => limit.unit = parse_unit(field)?,
                        other => return Err(format!("unknown field '{other}' in {what}.limit")),
                    }
                }
                descriptor.limit = Some(limit);
            }
            "hits_addend" | "hitsAddend" => {
                descriptor.hits_addend = Some(as_u64(field, "hits_addend")?)
            }
            "is_negative_hits" | "isNegativeHits" => {
                descriptor.is_negative_hits = field
                    .as_bool()
                    .ok_or_else(|| format!("{what}.is_negative_hits must be a boolean"))?;
            }
            other => return Err(format!("unknown field '{other}' in {what}")),
        }
    }
    Ok(descriptor)
}

fn parse_unit(value: &Value) -> Result<i32, String> {
    match value {
        Value::String(name) => pb::RateLimitUnit::from_str_name(name)
            .map(i32::from)
            .ok_or_else(|| format!("unknown unit '{name}'")),
        Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| "unit must be a name or a small integer".to_owned()),
        _ => Err("unit must be a name or a number".to_owned()),
    }
}

fn as_object<'v>(value: &'v Value, what: &str) -> Result<&'v Map<String, Value>, String> {
    value
        .as_object()
        .ok_or_else(|| format!("{what} must be an object"))
}

fn as_array<'v>(value: &'v Value, what: &str) -> Result<&'v Vec<Value>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("{what} must be a list"))
}

fn as_str<'v>(value: &'v Value, what: &str) -> Result<&'v str, String> {
    value
        .as_str()
        .ok_or_else(|| format!("{what} must be a string"))
}

/// Proto3 JSON writes 64-bit integers as strings, and accepts both.
fn as_u64(value: &Value, what: &str) -> Result<u64, String> {
    match value {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("{what} must be a non-negative integer"))
}

/// The proto3-JSON form of a response.
pub fn render_response(response: &pb::RateLimitResponse) -> Value {
    let code = |code: i32| Code::try_from(code).map_or("UNKNOWN", |c| c.as_str_name());
    let statuses: Vec<Value> = response
        .statuses
        .iter()
        .map(|status| {
            let mut out = Map::new();
            out.insert("code".into(), json!(code(status.code)));
            if let Some(limit) = &status.current_limit {
                let mut current = Map::new();
                if !limit.name.is_empty() {
                    current.insert("name".into(), json!(limit.name));
                }
                current.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
                let unit = WireUnit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
                current.insert("unit".into(), json!(unit));
                out.insert("currentLimit".into(), Value::Object(current));
            }
            if status.limit_remaining > 0 {
                out.insert("limitRemaining".into(), json!(status.limit_remaining));
            }
            if let Some(reset) = &status.duration_until_reset {
                let seconds = reset.seconds as f64 + f64::from(reset.nanos) / 1e9;
                out.insert("durationUntilReset".into(), json!(format!("{seconds}s")));
            }
            Value::Object(out)
        })
        .collect();
    let headers: Vec<Value> = response
        .response_headers_to_add
        .iter()
        .map(|h| json!({"key": h.key, "value": h.value}))
        .collect();
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(response.overall_code)));
    out.insert("statuses".into(), Value::Array(statuses));
    if !headers.is_empty() {
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}
