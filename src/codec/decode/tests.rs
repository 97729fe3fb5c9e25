use proptest::prelude::*;
use prost::Message;

use super::request;
use crate::codec::decode_request;
use crate::pb::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::pb::{RateLimitDescriptor, RateLimitRequest};

/// Short ASCII (what Envoy sends), any Unicode, and text long enough for two-byte lengths.
fn text() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z0-9_.-]{0,12}", ".{0,20}", "[a-z]{120,300}",]
}

fn entry() -> impl Strategy<Value = Entry> {
    (text(), text()).prop_map(|(key, value)| Entry { key, value })
}

/// Descriptors of entries only (read by hand), or with the fields that send prost the bytes.
fn descriptor(entries_only: bool) -> BoxedStrategy<RateLimitDescriptor> {
    let entries = proptest::collection::vec(entry(), 0..4);
    if entries_only {
        return entries
            .prop_map(|entries| RateLimitDescriptor {
                entries,
                ..Default::default()
            })
            .boxed();
    }
    (
        entries,
        proptest::option::weighted(0.2, (any::<u32>(), 0..8_i32)),
        proptest::option::weighted(0.2, any::<u64>()),
        proptest::bool::weighted(0.2),
    )
        .prop_map(
            |(entries, limit, hits_addend, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                    requests_per_unit,
                    unit,
                }),
                hits_addend,
                is_negative_hits,
            },
        )
        .boxed()
}

fn request_of(entries_only: bool) -> impl Strategy<Value = RateLimitRequest> {
    (
        text(),
        proptest::collection::vec(descriptor(entries_only), 0..12),
        prop_oneof![Just(0), 1..10_u32, any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

/// The service's decode and prost's agree: the same request, or both an error.
fn agree(bytes: &[u8]) -> Result<(), TestCaseError> {
    match (decode_request(bytes), RateLimitRequest::decode(bytes)) {
        (Ok(ours), Ok(prost)) => prop_assert_eq!(ours, prost),
        (Err(_), Err(_)) => {}
        (ours, prost) => prop_assert!(false, "ours {ours:?}, prost {prost:?}"),
    }
    Ok(())
}

proptest! {
    /// Requests of Envoy's usual shape are read by hand, and read as prost reads them.
    #[test]
    fn usual_requests_are_read_by_hand_as_prost_reads_them(sent in request_of(true)) {
        let bytes = sent.encode_to_vec();
        prop_assert_eq!(request(&bytes), Some(sent));
    }

    /// Any request, including overrides and per-descriptor hits, decodes as prost decodes it.
    #[test]
    fn any_request_decodes_as_prost_decodes_it(sent in request_of(false)) {
        agree(&sent.encode_to_vec())?;
    }

    /// Damaged requests (truncated, a byte changed, bytes appended) decode as prost decodes
    /// them, or fail as prost fails.
    #[test]
    fn damaged_requests_decode_or_fail_as_prost_does(
        sent in request_of(true),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        damage in 0..3_u8,
        tail in proptest::collection::vec(any::<u8>(), 1..8),
    ) {
        let mut bytes = sent.encode_to_vec();
        if !bytes.is_empty() {
            let at = at.index(bytes.len());
            match damage {
                0 => bytes.truncate(at),
                1 => bytes[at] = byte,
                _ => bytes.extend_from_slice(&tail),
            }
        }
        agree(&bytes)?;
    }

    /// Arbitrary bytes decode as prost decodes them, or fail as prost fails.
    #[test]
    fn arbitrary_bytes_decode_or_fail_as_prost_does(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        agree(&bytes)?;
    }
}

#[test]
fn a_repeated_domain_keeps_the_last_and_a_wide_hits_addend_keeps_its_low_bits() {
    // domain "a", then domain "b", then hits_addend 2^32 + 5 as a 5-byte varint.
    let bytes = [
        0x0a, 1, b'a', 0x0a, 1, b'b', 0x18, 0x85, 0x80, 0x80, 0x80, 0x10,
    ];
    let ours = request(&bytes).expect("read by hand");
    assert_eq!(ours.domain, "b");
    assert_eq!(ours.hits_addend, 5);
    assert_eq!(Some(ours), RateLimitRequest::decode(&bytes[..]).ok());
}

#[test]
fn unknown_fields_and_invalid_text_leave_the_request_to_prost() {
    // field 9 (unknown) after the domain: prost skips it.
    let unknown = [0x0a, 1, b'a', 0x48, 7];
    assert_eq!(request(&unknown), None);
    assert_eq!(
        decode_request(&unknown).map(|r| r.domain).ok(),
        Some("a".to_owned())
    );
    // a domain that is not UTF-8: prost's error.
    let invalid = [0x0a, 1, 0xff];
    assert_eq!(request(&invalid), None);
    assert!(decode_request(&invalid).is_err());
}
