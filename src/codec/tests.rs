use proptest::prelude::*;
use prost::Message;

use super::encode_response;
use crate::pb::rate_limit_response::{DescriptorStatus, Quota, RateLimit};
use crate::pb::{HeaderValue, RateLimitResponse};

fn by_hand(response: &RateLimitResponse) -> Vec<u8> {
    let mut bytes = Vec::new();
    encode_response(response, &mut bytes);
    bytes
}

/// Zero (proto3 leaves it out, and it is rlsd's most common value), small values, and any.
fn u32_value() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0), 1..200_u32, any::<u32>()]
}

fn status() -> impl Strategy<Value = DescriptorStatus> {
    let unit = prop_oneof![Just(0), 1..8_i32, any::<i32>()];
    let limit =
        (".{0,40}", u32_value(), unit).prop_map(|(name, requests_per_unit, unit)| RateLimit {
            name,
            requests_per_unit,
            unit,
        });
    let seconds = prop_oneof![Just(0), 1..100_i64, any::<i64>()];
    let nanos = prop_oneof![Just(0), 1..1_000_000_000_i32, any::<i32>()];
    let duration =
        (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos });
    (
        prop_oneof![Just(0), Just(1), Just(2), any::<i32>()],
        proptest::option::of(limit),
        u32_value(),
        proptest::option::of(duration),
    )
        .prop_map(
            |(code, current_limit, limit_remaining, duration_until_reset)| DescriptorStatus {
                code,
                current_limit,
                limit_remaining,
                duration_until_reset,
                quota: None,
            },
        )
}

fn header() -> impl Strategy<Value = HeaderValue> {
    (".{0,30}", ".{0,200}").prop_map(|(key, value)| HeaderValue {
        key,
        value,
        raw_value: Vec::new(),
    })
}

proptest! {
    /// Whatever rlsd puts in a response (and values it never uses: negative enums and durations,
    /// long names), the bytes are exactly prost's.
    #[test]
    fn responses_encode_as_prost_encodes_them(
        overall_code in prop_oneof![Just(0), Just(1), Just(2), any::<i32>()],
        statuses in proptest::collection::vec(status(), 0..12),
        headers in proptest::collection::vec(header(), 0..5),
    ) {
        let response = RateLimitResponse {
            overall_code,
            statuses,
            response_headers_to_add: headers,
            ..Default::default()
        };
        let bytes = by_hand(&response);
        prop_assert_eq!(&bytes, &response.encode_to_vec());
        prop_assert_eq!(RateLimitResponse::decode(bytes.as_slice()).expect("decodes"), response);
    }
}

/// An over-limit answer as rlsd builds it: zero remaining, a reset under a second.
#[test]
fn an_over_limit_answer_encodes_as_prost_encodes_it() {
    let response = RateLimitResponse {
        overall_code: 2,
        statuses: vec![DescriptorStatus {
            code: 2,
            current_limit: Some(RateLimit {
                name: "edge".to_owned(),
                requests_per_unit: 10,
                unit: 1,
            }),
            limit_remaining: 0,
            duration_until_reset: Some(prost_types::Duration {
                seconds: 0,
                nanos: 250_000_000,
            }),
            quota: None,
        }],
        response_headers_to_add: vec![HeaderValue {
            key: "retry-after".to_owned(),
            value: "1".to_owned(),
            raw_value: Vec::new(),
        }],
        ..Default::default()
    };
    assert_eq!(by_hand(&response), response.encode_to_vec());
}

#[test]
fn fields_rlsd_never_sets_go_through_prost() {
    let status = DescriptorStatus {
        code: 1,
        limit_remaining: 3,
        ..Default::default()
    };
    let with = |change: &dyn Fn(&mut RateLimitResponse)| {
        let mut response = RateLimitResponse {
            overall_code: 1,
            statuses: vec![status.clone()],
            ..Default::default()
        };
        change(&mut response);
        response
    };
    let responses = [
        with(&|r| r.raw_body = b"body".to_vec()),
        with(&|r| r.request_headers_to_add.push(HeaderValue::default())),
        with(&|r| r.dynamic_metadata = Some(prost_types::Struct::default())),
        with(&|r| r.quota = Some(Quota::default())),
        with(&|r| r.statuses[0].quota = Some(Quota::default())),
        with(&|r| {
            r.response_headers_to_add.push(HeaderValue {
                key: "k".to_owned(),
                value: String::new(),
                raw_value: b"raw".to_vec(),
            })
        }),
    ];
    for response in responses {
        assert_eq!(by_hand(&response), response.encode_to_vec(), "{response:?}");
    }
}

#[test]
fn varint_lengths_match_prost() {
    for value in [
        0,
        1,
        127,
        128,
        16_383,
        16_384,
        u64::from(u32::MAX),
        u64::MAX,
    ] {
        assert_eq!(
            super::varint_len(value),
            prost::encoding::encoded_len_varint(value),
            "{value}"
        );
    }
}
