//! `RateLimitRequest` read by hand from one contiguous slice, for the shape Envoy sends:
//! a domain, descriptors of entries, and a request `hits_addend`. Vectors are sized before they
//! are filled (prost grows them push by push) and each string is copied once, at its final size.
//! Anything else on the wire (other descriptor fields, unknown fields, unexpected wire types,
//! bad UTF-8, truncation) gives `None`, and the caller decodes the same bytes with prost, so
//! the result, or the error, is always prost's.

use crate::pb::rate_limit_descriptor::Entry;
use crate::pb::{RateLimitDescriptor, RateLimitRequest};

/// A field's payload, by wire type.
enum Payload<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The bytes left a shape this reader does not take.
struct Unusual;

/// `bytes` as a `RateLimitRequest`, when it has only the fields Envoy usually sends.
pub(super) fn request(bytes: &[u8]) -> Option<RateLimitRequest> {
    read_request(bytes).ok()
}

fn read_request(bytes: &[u8]) -> Result<RateLimitRequest, Unusual> {
    let mut request = RateLimitRequest {
        descriptors: Vec::with_capacity(count(bytes, 2)?),
        ..Default::default()
    };
    let mut rest = bytes;
    while let Some((field, payload)) = next_field(&mut rest)? {
        match (field, payload) {
            (1, Payload::Bytes(text)) => request.domain = string(text)?,
            (2, Payload::Bytes(message)) => request.descriptors.push(read_descriptor(message)?),
            // prost keeps a uint32's low 32 bits, as protobuf specifies.
            (3, Payload::Varint(hits)) => request.hits_addend = hits as u32,
            _ => return Err(Unusual),
        }
    }
    Ok(request)
}

fn read_descriptor(bytes: &[u8]) -> Result<RateLimitDescriptor, Unusual> {
    let mut descriptor = RateLimitDescriptor {
        entries: Vec::with_capacity(count(bytes, 1)?),
        ..Default::default()
    };
    let mut rest = bytes;
    while let Some((field, payload)) = next_field(&mut rest)? {
        match (field, payload) {
            (1, Payload::Bytes(message)) => descriptor.entries.push(read_entry(message)?),
            _ => return Err(Unusual),
        }
    }
    Ok(descriptor)
}

fn read_entry(bytes: &[u8]) -> Result<Entry, Unusual> {
    let mut entry = Entry::default();
    let mut rest = bytes;
    while let Some((field, payload)) = next_field(&mut rest)? {
        match (field, payload) {
            (1, Payload::Bytes(text)) => entry.key = string(text)?,
            (2, Payload::Bytes(text)) => entry.value = string(text)?,
            _ => return Err(Unusual),
        }
    }
    Ok(entry)
}

/// How many times `field` occurs in `bytes`, which must be well formed.
fn count(bytes: &[u8], field: u32) -> Result<usize, Unusual> {
    let mut rest = bytes;
    let mut n = 0;
    while let Some((number, _)) = next_field(&mut rest)? {
        n += usize::from(number == field);
    }
    Ok(n)
}

fn string(bytes: &[u8]) -> Result<String, Unusual> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| Unusual)
}

/// Takes the next field off `rest`; `None` at the end.
#[inline]
fn next_field<'a>(rest: &mut &'a [u8]) -> Result<Option<(u32, Payload<'a>)>, Unusual> {
    if rest.is_empty() {
        return Ok(None);
    }
    let key = varint(rest)?;
    let field = u32::try_from(key >> 3).map_err(|_| Unusual)?;
    if field == 0 {
        return Err(Unusual);
    }
    let payload = match key & 7 {
        0 => Payload::Varint(varint(rest)?),
        2 => {
            let len = usize::try_from(varint(rest)?).map_err(|_| Unusual)?;
            if len > rest.len() {
                return Err(Unusual);
            }
            let (bytes, after) = rest.split_at(len);
            *rest = after;
            Payload::Bytes(bytes)
        }
        _ => return Err(Unusual),
    };
    Ok(Some((field, payload)))
}

/// A base-128 varint of at most ten bytes whose value fits in 64 bits.
#[inline]
fn varint(rest: &mut &[u8]) -> Result<u64, Unusual> {
    // Tags and the lengths of keys and values are almost always below 128: one byte.
    if let Some((&byte, after)) = rest.split_first()
        && byte < 0x80
    {
        *rest = after;
        return Ok(u64::from(byte));
    }
    long_varint(rest)
}

#[cold]
fn long_varint(rest: &mut &[u8]) -> Result<u64, Unusual> {
    let mut value = 0u64;
    for (i, &byte) in rest.iter().enumerate().take(10) {
        if i == 9 && byte > 1 {
            return Err(Unusual);
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            *rest = &rest[i + 1..];
            return Ok(value);
        }
    }
    Err(Unusual)
}

#[cfg(test)]
mod tests;
