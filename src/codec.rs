//! The gRPC codec of `RateLimitService`: prost's, except that a `RateLimitResponse` is encoded
//! by hand. prost walks every nested message twice (its length, then its bytes) and writes each
//! varint a byte at a time through `BufMut`; the response is the one message rlsd writes per
//! request, with a status per descriptor, and most of its fields are small numbers whose sizes
//! are known from their values. Fields rlsd never sets (request headers, raw body, dynamic
//! metadata, quotas, raw header values) send the whole response through prost instead, so
//! whatever the message holds, the bytes are prost's.
//!
//! A `RateLimitRequest` of the usual shape is read by hand too (see `decode`); any other
//! falls back to prost, so the decoded request, or the error, is prost's.

mod decode;

use std::marker::PhantomData;

use prost::Message;
use prost::bytes::{Buf, BufMut};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

use crate::pb::rate_limit_response::{DescriptorStatus, RateLimit};
use crate::pb::{HeaderValue, RateLimitRequest, RateLimitResponse};

/// The codec `build.rs` names for the generated client and server.
#[derive(Debug, Clone)]
pub struct RlsCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for RlsCodec<T, U> {
    fn default() -> Self {
        RlsCodec {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for RlsCodec<T, U>
where
    T: WireEncode + Send + 'static,
    U: WireDecode + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = RlsEncoder<T>;
    type Decoder = RlsDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        RlsEncoder { _type: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        RlsDecoder(ProstDecoder::default())
    }
}

/// Writes messages with [`WireEncode`].
#[derive(Debug, Clone)]
pub struct RlsEncoder<T> {
    _type: PhantomData<T>,
}

impl<T: WireEncode> Encoder for RlsEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_wire(buf);
        Ok(())
    }
}

/// Reads messages with [`WireDecode`], falling back to prost.
#[derive(Debug)]
pub struct RlsDecoder<U>(ProstDecoder<U>);

impl<U: WireDecode> Decoder for RlsDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // A gRPC message arrives whole in one buffer, so its bytes are one slice.
        if buf.chunk().len() == buf.remaining()
            && let Some(message) = U::decode_wire(buf.chunk())
        {
            buf.advance(buf.remaining());
            return Ok(Some(message));
        }
        self.0.decode(buf)
    }
}

/// A message as the service's codec reads it.
pub trait WireDecode: Message + Default {
    /// The message in `bytes`, or `None` to have prost decode them.
    fn decode_wire(bytes: &[u8]) -> Option<Self> {
        let _ = bytes;
        None
    }
}

impl WireDecode for RateLimitRequest {
    fn decode_wire(bytes: &[u8]) -> Option<Self> {
        decode::request(bytes)
    }
}

impl WireDecode for RateLimitResponse {}

/// Decodes a `RateLimitRequest` as the service does: by hand when it can, else with prost.
///
/// # Errors
/// prost's, when the bytes are not a `RateLimitRequest`.
pub fn decode_request(bytes: &[u8]) -> Result<RateLimitRequest, prost::DecodeError> {
    RateLimitRequest::decode_wire(bytes).map_or_else(|| RateLimitRequest::decode(bytes), Ok)
}

/// A message as the service's codec writes it.
pub trait WireEncode {
    /// Appends the message's protobuf encoding (no gRPC framing) to `buf`.
    fn encode_wire(&self, buf: &mut impl BufMut);
}

impl WireEncode for RateLimitRequest {
    fn encode_wire(&self, buf: &mut impl BufMut) {
        // `encode` fails only when `buf` cannot grow, and gRPC's buffers always can.
        let _ = self.encode(buf);
    }
}

impl WireEncode for RateLimitResponse {
    fn encode_wire(&self, buf: &mut impl BufMut) {
        encode_response(self, buf);
    }
}

/// Appends `response`'s protobuf encoding to `buf`: the bytes prost writes, written directly.
pub fn encode_response(response: &RateLimitResponse, buf: &mut impl BufMut) {
    if !by_hand(response) {
        let _ = response.encode(buf);
        return;
    }
    put_enum(buf, 1, response.overall_code);
    for status in &response.statuses {
        put_key(buf, 2, LEN);
        put_varint(buf, status_len(status) as u64);
        put_status(buf, status);
    }
    for header in &response.response_headers_to_add {
        put_key(buf, 3, LEN);
        put_varint(buf, header_len(header) as u64);
        put_string(buf, 1, &header.key);
        put_string(buf, 2, &header.value);
    }
}

/// Whether every field set is one this encoder writes. The structs are taken apart field by
/// field, so a field added to the protos fails to compile here instead of being dropped.
fn by_hand(response: &RateLimitResponse) -> bool {
    let RateLimitResponse {
        overall_code: _,
        statuses,
        response_headers_to_add,
        request_headers_to_add,
        raw_body,
        dynamic_metadata,
        quota,
    } = response;
    let plain_status = |status: &DescriptorStatus| {
        let DescriptorStatus {
            code: _,
            current_limit,
            limit_remaining: _,
            duration_until_reset,
            quota,
        } = status;
        if let Some(RateLimit {
            name: _,
            requests_per_unit: _,
            unit: _,
        }) = current_limit
        {}
        if let Some(prost_types::Duration {
            seconds: _,
            nanos: _,
        }) = duration_until_reset
        {}
        quota.is_none()
    };
    let plain_header = |header: &HeaderValue| {
        let HeaderValue {
            key: _,
            value: _,
            raw_value,
        } = header;
        raw_value.is_empty()
    };
    request_headers_to_add.is_empty()
        && raw_body.is_empty()
        && dynamic_metadata.is_none()
        && quota.is_none()
        && statuses.iter().all(plain_status)
        && response_headers_to_add.iter().all(plain_header)
}

/// Wire types.
const VARINT: u8 = 0;
const LEN: u8 = 2;

fn put_status(buf: &mut impl BufMut, status: &DescriptorStatus) {
    put_enum(buf, 1, status.code);
    if let Some(limit) = &status.current_limit {
        put_key(buf, 2, LEN);
        put_varint(buf, rate_limit_len(limit) as u64);
        // In field-number order, as prost writes them (`name`, declared first, is field 3).
        put_uint(buf, 1, u64::from(limit.requests_per_unit));
        put_enum(buf, 2, limit.unit);
        put_string(buf, 3, &limit.name);
    }
    put_uint(buf, 3, u64::from(status.limit_remaining));
    if let Some(duration) = &status.duration_until_reset {
        put_key(buf, 4, LEN);
        put_varint(buf, duration_len(duration) as u64);
        put_int(buf, 1, duration.seconds);
        put_int(buf, 2, i64::from(duration.nanos));
    }
}

fn status_len(status: &DescriptorStatus) -> usize {
    let limit = status
        .current_limit
        .as_ref()
        .map_or(0, |limit| nested_len(rate_limit_len(limit)));
    let duration = status
        .duration_until_reset
        .as_ref()
        .map_or(0, |duration| nested_len(duration_len(duration)));
    int_len(i64::from(status.code)) + limit + uint_len(u64::from(status.limit_remaining)) + duration
}

fn rate_limit_len(limit: &RateLimit) -> usize {
    string_len(&limit.name)
        + uint_len(u64::from(limit.requests_per_unit))
        + int_len(i64::from(limit.unit))
}

fn duration_len(duration: &prost_types::Duration) -> usize {
    int_len(duration.seconds) + int_len(i64::from(duration.nanos))
}

fn header_len(header: &HeaderValue) -> usize {
    string_len(&header.key) + string_len(&header.value)
}

/// A field of a nested message whose own length is `len`: key, length, bytes.
#[inline]
fn nested_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

/// Every field here has a number below 16: its key is one byte.
#[inline]
fn put_key(buf: &mut impl BufMut, field: u8, wire_type: u8) {
    buf.put_u8(field << 3 | wire_type);
}

/// proto3 leaves out a scalar that holds its default, as prost does.
#[inline]
fn put_uint(buf: &mut impl BufMut, field: u8, value: u64) {
    if value != 0 {
        put_key(buf, field, VARINT);
        put_varint(buf, value);
    }
}

/// Signed integers and enums: a negative value is its 64-bit two's complement, ten bytes.
#[inline]
fn put_int(buf: &mut impl BufMut, field: u8, value: i64) {
    put_uint(buf, field, value as u64);
}

#[inline]
fn put_enum(buf: &mut impl BufMut, field: u8, value: i32) {
    put_int(buf, field, i64::from(value));
}

#[inline]
fn put_string(buf: &mut impl BufMut, field: u8, text: &str) {
    if !text.is_empty() {
        put_key(buf, field, LEN);
        put_varint(buf, text.len() as u64);
        buf.put_slice(text.as_bytes());
    }
}

#[inline]
fn uint_len(value: u64) -> usize {
    if value == 0 { 0 } else { 1 + varint_len(value) }
}

#[inline]
fn int_len(value: i64) -> usize {
    uint_len(value as u64)
}

#[inline]
fn string_len(text: &str) -> usize {
    if text.is_empty() {
        0
    } else {
        nested_len(text.len())
    }
}

#[inline]
fn varint_len(value: u64) -> usize {
    // Seven bits a byte; `| 1` makes zero one byte long.
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

#[inline]
fn put_varint(buf: &mut impl BufMut, mut value: u64) {
    if value < 0x80 {
        buf.put_u8(value as u8);
        return;
    }
    let mut bytes = [0_u8; 10];
    let mut len = 0;
    while value >= 0x80 {
        bytes[len] = (value as u8) | 0x80;
        value >>= 7;
        len += 1;
    }
    bytes[len] = value as u8;
    buf.put_slice(&bytes[..=len]);
}

#[cfg(test)]
mod tests;
