//! Costs charged after the fact (Envoy Gateway's `responseCost`, AI Gateway's token budgets):
//! a descriptor's own `hits_addend` is a charge for work already done, recorded whatever the
//! answer and in every limit of the call, while plain request counting keeps rlsd's rule that a
//! denied request consumes nothing. Over real gRPC, in process and on a real Redis.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{descriptor, request, spawn_server};
use rlsd::limit::Algorithm;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::service::ServiceSettings;
use rlsd::store::{AnyStore, MemoryStore, RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

/// A per-user token budget of 1000 an hour for each algorithm, and a budget of 1500 for the
/// model every user shares.
fn budgets() -> String {
    let mut yaml = String::from("domain: ai\ndescriptors:\n");
    for algorithm in Algorithm::ALL {
        let burst = if algorithm.takes_burst() {
            ", burst: 1000"
        } else {
            ""
        };
        yaml.push_str(&format!(
            "  - key: user_{0}\n    rate_limit: {{unit: hour, requests_per_unit: 1000, algorithm: {0}{burst}}}\n",
            algorithm.name()
        ));
    }
    yaml.push_str("  - key: model\n    rate_limit: {unit: hour, requests_per_unit: 1500}\n");
    yaml.push_str("  - key: chg\n    rate_limit: {unit: hour, requests_per_unit: 5}\n");
    yaml.push_str(
        "  - key: chg_always\n    rate_limit: {unit: hour, requests_per_unit: 10, charge: always}\n",
    );
    yaml
}

/// Starts rlsd on `store` with [`budgets`]; a client for it, and what stops it.
async fn serve(store: AnyStore) -> (RateLimitServiceClient<Channel>, impl FnOnce()) {
    let (grpc, _http, stop, _task) =
        spawn_server(&budgets(), Arc::new(store), ServiceSettings::default()).await;
    let client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    (client, move || {
        let _ = stop.send(());
    })
}

async fn memory() -> AnyStore {
    AnyStore::Memory(Arc::new(MemoryStore::new(10_000)))
}

async fn redis(server: &RedisServer) -> AnyStore {
    let mut settings = RedisSettings::new(server.url());
    settings.command_timeout = Duration::from_secs(2);
    AnyStore::Redis(rlsd::store::OverLimitCache::new(
        RedisStore::connect(settings).await.expect("connect"),
        1_000,
    ))
}

/// A descriptor's entries and its own `hits_addend`.
type Costed<'a> = (&'a [(&'a str, &'a str)], Option<u64>);

/// One call: each `(entries, cost)` a descriptor, `cost` its own `hits_addend` (`None`: the
/// request's). The overall code and each descriptor's code and remaining.
async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    descriptors: &[Costed<'_>],
    request_hits: u32,
) -> (Code, Vec<(Code, u32)>) {
    let descriptors = descriptors
        .iter()
        .map(|(entries, cost)| {
            let mut d = descriptor(entries);
            d.hits_addend = *cost;
            d
        })
        .collect();
    let mut req = request("ai", descriptors);
    req.hits_addend = request_hits;
    let response = client
        .should_rate_limit(req)
        .await
        .expect("answer")
        .into_inner();
    let code = |c: i32| Code::try_from(c).expect("known code");
    (
        code(response.overall_code),
        response
            .statuses
            .iter()
            .map(|s| (code(s.code), s.limit_remaining))
            .collect(),
    )
}

/// The sequence: check, charge 800, check, charge 500 (past the limit: still recorded),
/// and the next check is over.
async fn a_charge_past_the_limit_is_recorded(client: &mut RateLimitServiceClient<Channel>) {
    for algorithm in Algorithm::ALL {
        let key = format!("user_{}", algorithm.name());
        let user: &[(&str, &str)] = &[(&key, "u")];
        let check = call(client, &[(user, Some(0))], 0).await;
        assert_eq!(check.0, Code::Ok, "{algorithm}: first check");
        let charged = call(client, &[(user, Some(800))], 0).await;
        assert_eq!(charged.1, [(Code::Ok, 200)], "{algorithm}: charge 800");
        assert_eq!(
            call(client, &[(user, Some(0))], 0).await.0,
            Code::Ok,
            "{algorithm}"
        );
        let over = call(client, &[(user, Some(500))], 0).await;
        assert_eq!(over.0, Code::OverLimit, "{algorithm}: charge 500 is over");
        let after = call(client, &[(user, Some(0))], 0).await;
        assert_eq!(
            after.1,
            [(Code::OverLimit, 0)],
            "{algorithm}: the 500 were recorded, so the budget is spent"
        );
    }
}

/// A charge past one limit of the call still lands in the other.
async fn a_charge_lands_in_every_limit_of_the_call(client: &mut RateLimitServiceClient<Channel>) {
    let user: &[(&str, &str)] = &[("user_fixed_window", "v")];
    let model: &[(&str, &str)] = &[("model", "m")];
    let charged = call(client, &[(user, Some(1200)), (model, Some(1200))], 0).await;
    assert_eq!(charged.0, Code::OverLimit);
    assert_eq!(
        charged.1,
        [(Code::OverLimit, 0), (Code::Ok, 300)],
        "the user budget was charged past its end, the model budget took the 1200"
    );
    let model_left = call(client, &[(model, Some(0))], 0).await;
    assert_eq!(model_left.1, [(Code::Ok, 300)]);
}

/// Issue 41's sequences: a charge recorded past the limit answers what it leaves, 0, never
/// the remaining from before it.
async fn a_recorded_charge_reports_what_is_left(client: &mut RateLimitServiceClient<Channel>) {
    let chg: &[(&str, &str)] = &[("chg", "v")];
    assert_eq!(call(client, &[(chg, Some(3))], 0).await.1, [(Code::Ok, 2)]);
    let second = call(client, &[(chg, Some(3))], 0).await;
    assert_eq!(second, (Code::OverLimit, vec![(Code::OverLimit, 0)]));
    assert_eq!(
        call(client, &[(chg, Some(0))], 0).await.1,
        [(Code::OverLimit, 0)],
        "the 3 were recorded"
    );
    // The request's own hits under `charge: always`.
    let always: &[(&str, &str)] = &[("chg_always", "v")];
    assert_eq!(call(client, &[(always, None)], 8).await.1, [(Code::Ok, 2)]);
    let second = call(client, &[(always, None)], 5).await;
    assert_eq!(second, (Code::OverLimit, vec![(Code::OverLimit, 0)]));
}

/// Plain counting (the request's own hits, no descriptor cost) is unchanged: a denied request
/// takes nothing from any of its limits.
async fn plain_counting_denied_takes_nothing(client: &mut RateLimitServiceClient<Channel>) {
    let user: &[(&str, &str)] = &[("user_fixed_window", "plain")];
    let model: &[(&str, &str)] = &[("model", "plain")];
    assert_eq!(
        call(client, &[(user, None), (model, None)], 800).await.0,
        Code::Ok
    );
    let denied = call(client, &[(user, None), (model, None)], 500).await;
    assert_eq!(denied.0, Code::OverLimit);
    assert_eq!(denied.1, [(Code::OverLimit, 200), (Code::Ok, 700)]);
    let after = call(client, &[(user, Some(0)), (model, Some(0))], 0).await;
    assert_eq!(after.1, [(Code::Ok, 200), (Code::Ok, 700)], "nothing taken");
}

/// Hits given back land even on a key a charge left over its limit: a refund never denies.
async fn a_refund_lands_on_a_key_in_debt(client: &mut RateLimitServiceClient<Channel>) {
    for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket] {
        let key = format!("user_{}", algorithm.name());
        let user: &[(&str, &str)] = &[(&key, "debt")];
        assert_eq!(
            call(client, &[(user, Some(1500))], 0).await.0,
            Code::OverLimit
        );
        // The first refund leaves the key still over its limit; it lands all the same.
        for back in [200, 800] {
            let mut refund = descriptor(user);
            refund.hits_addend = Some(back);
            refund.is_negative_hits = true;
            let given = client
                .should_rate_limit(request("ai", vec![refund]))
                .await
                .expect("answer")
                .into_inner();
            assert_eq!(
                given.overall_code,
                Code::Ok as i32,
                "{algorithm}: a refund never denies"
            );
        }
        let after = call(client, &[(user, Some(0))], 0).await;
        assert_eq!(
            after.1,
            [(Code::Ok, 500)],
            "{algorithm}: 1500 charged, 1000 back"
        );
    }
}

/// Every scenario above against rlsd on `store`.
async fn every_charge_scenario(store: AnyStore) {
    let (mut client, stop) = serve(store).await;
    a_charge_past_the_limit_is_recorded(&mut client).await;
    a_charge_lands_in_every_limit_of_the_call(&mut client).await;
    a_recorded_charge_reports_what_is_left(&mut client).await;
    plain_counting_denied_takes_nothing(&mut client).await;
    a_refund_lands_on_a_key_in_debt(&mut client).await;
    stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_in_process() {
    every_charge_scenario(memory().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_on_redis() {
    let server = RedisServer::start();
    every_charge_scenario(redis(&server).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_on_a_cluster() {
    let cluster = rlsd_testkit::cluster::RedisCluster::start();
    let mut settings = rlsd::store::ClusterSettings::new(cluster.urls());
    settings.command_timeout = Duration::from_secs(2);
    let store = rlsd::store::ClusterStore::connect(settings)
        .await
        .expect("connect");
    every_charge_scenario(AnyStore::Cluster(store)).await;
}

/// `charge: never` keeps a denied request's descriptor costs out, as before; `charge: always`
/// records even plain counting, as envoyproxy/ratelimit does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_can_say_which_hits_are_charges() {
    let yaml = "domain: ai\ndescriptors:\n  - key: never\n    rate_limit: {unit: hour, requests_per_unit: 10, charge: never}\n  - key: always\n    rate_limit: {unit: hour, requests_per_unit: 10, charge: always}\n";
    let (grpc, _http, stop, _task) = spawn_server(
        yaml,
        Arc::new(MemoryStore::new(1_000)),
        ServiceSettings::default(),
    )
    .await;
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let never: &[(&str, &str)] = &[("never", "v")];
    let always: &[(&str, &str)] = &[("always", "v")];
    assert_eq!(
        call(&mut client, &[(never, Some(11))], 0).await.0,
        Code::OverLimit
    );
    assert_eq!(
        call(&mut client, &[(never, Some(0))], 0).await.1,
        [(Code::Ok, 10)]
    );
    assert_eq!(
        call(&mut client, &[(always, None)], 11).await.0,
        Code::OverLimit
    );
    assert_eq!(
        call(&mut client, &[(always, Some(0))], 0).await.1,
        [(Code::OverLimit, 0)]
    );
    let _ = stop.send(());
}
