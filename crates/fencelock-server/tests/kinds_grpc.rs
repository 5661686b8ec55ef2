//! The lock kinds over gRPC: modes, multi-locks, release-all, downgrade and
//! elections, and their bad inputs refused with INVALID_ARGUMENT and the state
//! unchanged.

use std::time::Duration;

use fencelock_server::grpc::pb::locks_client::LocksClient;
use fencelock_server::grpc::pb::{
    AcquireAllRequest, AcquireRequest, CampaignRequest, DowngradeRequest, EventKind,
    GetLockRequest, LeaderRequest, ListLocksRequest, ProclaimRequest, ReleaseAllRequest,
    ReleaseRequest, WatchRequest,
};
use fencelock_server::grpc::ERROR_CODE_METADATA;
use fencelock_server::{EngineConfig, Server, ServerConfig};
use tonic::transport::Channel;
use tonic::Code;

const STEP: Duration = Duration::from_secs(30);

async fn start() -> (Server, LocksClient<Channel>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a temporary data directory");
    let server = Server::start(ServerConfig::new(
        "127.0.0.1:0".parse().expect("an address"),
        EngineConfig::new(dir.path()),
    ))
    .await
    .expect("the server starts");
    let client = LocksClient::connect(format!("http://{}", server.local_addr()))
        .await
        .expect("the gRPC client connects");
    (server, client, dir)
}

fn acquire(name: &str, mode: &str) -> AcquireRequest {
    AcquireRequest {
        name: name.to_owned(),
        ttl_ms: Some(30_000),
        mode: mode.to_owned(),
        ..Default::default()
    }
}

#[track_caller]
fn refused<T: std::fmt::Debug>(result: Result<tonic::Response<T>, tonic::Status>, code: &str) {
    let status = result.expect_err("refused");
    let got = status
        .metadata()
        .get(ERROR_CODE_METADATA)
        .and_then(|v| v.to_str().ok());
    assert_eq!(got, Some(code), "{status:?}");
    if code == "invalid_argument" {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }
}

/// Every lock's name, holders (fence, mode, value) and waiters.
async fn state(client: &mut LocksClient<Channel>) -> Vec<String> {
    let locks = client
        .list_locks(ListLocksRequest::default())
        .await
        .expect("listed")
        .into_inner()
        .locks;
    locks
        .into_iter()
        .map(|l| {
            let holders: Vec<String> = l
                .holders
                .iter()
                .map(|h| format!("{}:{}:{:?}", h.fence, h.mode, h.value))
                .collect();
            format!("{} {:?} {}", l.name, holders, l.waiters)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_multi_locks_downgrade_and_elections_over_grpc() {
    let (server, mut client, _dir) = start().await;
    let mut events = client
        .watch(WatchRequest {
            prefix: "g:".into(),
            ..Default::default()
        })
        .await
        .expect("watching")
        .into_inner();

    let r = client
        .acquire(acquire("g:rw", "shared"))
        .await
        .expect("granted")
        .into_inner();
    assert_eq!(r.mode, "shared");
    client
        .acquire(acquire("g:rw", "shared"))
        .await
        .expect("a second reader");
    refused(client.acquire(acquire("g:rw", "exclusive")).await, "held");

    let w = client
        .acquire(acquire("g:w", ""))
        .await
        .expect("a writer")
        .into_inner();
    assert_eq!(w.mode, "exclusive");
    let d = client
        .downgrade(DowngradeRequest {
            name: "g:w".into(),
            owner_token: w.owner_token.clone(),
        })
        .await
        .expect("downgraded")
        .into_inner();
    assert_eq!((d.mode.as_str(), d.fence), ("shared", w.fence));
    let info = client
        .get_lock(GetLockRequest { name: "g:w".into() })
        .await
        .expect("shown")
        .into_inner();
    assert_eq!(info.holders[0].mode, "shared");

    let all = client
        .acquire_all(AcquireAllRequest {
            names: vec!["g:b".into(), "g:a".into()],
            ttl_ms: Some(30_000),
            ..Default::default()
        })
        .await
        .expect("granted")
        .into_inner();
    let names: Vec<&str> = all.grants.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["g:b", "g:a"]);
    let released = client
        .release_all(ReleaseAllRequest {
            grants: all
                .grants
                .iter()
                .map(|g| ReleaseRequest {
                    name: g.name.clone(),
                    owner_token: g.owner_token.clone(),
                })
                .collect(),
        })
        .await
        .expect("released")
        .into_inner();
    assert_eq!(released.released, [true, true]);

    let lead = client
        .campaign(CampaignRequest {
            name: "g:e".into(),
            value: "host-1".into(),
            ttl_ms: Some(30_000),
            ..Default::default()
        })
        .await
        .expect("leading")
        .into_inner();
    client
        .proclaim(ProclaimRequest {
            name: "g:e".into(),
            owner_token: lead.owner_token.clone(),
            value: "host-1b".into(),
        })
        .await
        .expect("proclaimed");
    let leader = client
        .leader(LeaderRequest { name: "g:e".into() })
        .await
        .expect("asked")
        .into_inner()
        .leader
        .expect("a leader");
    assert_eq!(
        (leader.value.as_str(), leader.term),
        ("host-1b", lead.fence)
    );
    client
        .resign(ReleaseRequest {
            name: "g:e".into(),
            owner_token: lead.owner_token,
        })
        .await
        .expect("resigned");
    let none = client
        .leader(LeaderRequest { name: "g:e".into() })
        .await
        .expect("asked")
        .into_inner();
    assert_eq!(none.leader, None);

    // Observing: the watch saw the downgrade and the proclaimed value.
    let mut seen = Vec::new();
    while !seen.iter().any(|(k, _)| *k == EventKind::Proclaimed as i32) {
        let e = tokio::time::timeout(STEP, events.message())
            .await
            .expect("an event in time")
            .expect("the stream stays up")
            .expect("an event");
        seen.push((e.kind, e.value.clone()));
    }
    assert!(
        seen.iter().any(|(k, _)| *k == EventKind::Downgraded as i32),
        "{seen:?}"
    );
    assert!(
        seen.contains(&(EventKind::Proclaimed as i32, Some("host-1b".into()))),
        "{seen:?}"
    );
    server.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kind_inputs_over_grpc_change_nothing() {
    let (server, mut client, _dir) = start().await;
    let held = client
        .acquire(acquire("g:held", ""))
        .await
        .expect("granted")
        .into_inner();
    let before = state(&mut client).await;
    refused(
        client.acquire(acquire("g:x", "writer")).await,
        "invalid_argument",
    );
    let set = |names: Vec<String>| AcquireAllRequest {
        names,
        ttl_ms: Some(1000),
        ..Default::default()
    };
    refused(client.acquire_all(set(vec![])).await, "invalid_argument");
    refused(
        client
            .acquire_all(set(vec!["g:x".into(), "g:x".into()]))
            .await,
        "invalid_argument",
    );
    let many = (0..65).map(|i| format!("g:{i}")).collect();
    refused(client.acquire_all(set(many)).await, "invalid_argument");
    refused(
        client
            .acquire_all(AcquireAllRequest {
                mode: "both".into(),
                ..set(vec!["g:x".into()])
            })
            .await,
        "invalid_argument",
    );
    refused(
        client
            .campaign(CampaignRequest {
                name: "g:e".into(),
                value: "v".repeat(4097),
                ttl_ms: Some(1000),
                ..Default::default()
            })
            .await,
        "invalid_argument",
    );
    refused(
        client
            .proclaim(ProclaimRequest {
                name: "g:held".into(),
                owner_token: held.owner_token.clone(),
                value: "v".repeat(4097),
            })
            .await,
        "invalid_argument",
    );
    refused(
        client
            .release_all(ReleaseAllRequest { grants: vec![] })
            .await,
        "invalid_argument",
    );
    refused(
        client
            .downgrade(DowngradeRequest {
                name: "g:held".into(),
                owner_token: "0".repeat(32),
            })
            .await,
        "not_held",
    );
    assert_eq!(state(&mut client).await, before);
    server.shutdown().await.expect("clean shutdown");
}
