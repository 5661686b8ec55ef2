//! gRPC server reflection: a real reflection client (the protocol `grpcurl` speaks)
//! discovers `fencelock.v1.Locks` and its methods from the server itself, with and
//! without authentication, over v1 and the older v1alpha.

use crate::support;

use fencelock_server::{AuthConfig, Role, TokenConfig};
use prost::Message;
use support::TestServer;
use tonic::transport::Channel;
use tonic_reflection::pb::{v1, v1alpha};

async fn channel(server: &TestServer) -> Channel {
    Channel::from_shared(format!("http://{}", server.addr()))
        .expect("a URL")
        .connect()
        .await
        .expect("the gRPC client connects")
}

/// One reflection request over v1, its one answer.
async fn ask_v1(
    channel: Channel,
    request: v1::server_reflection_request::MessageRequest,
) -> Result<v1::server_reflection_response::MessageResponse, tonic::Status> {
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let answer = answers.message().await?.expect("one answer");
    Ok(answer.message_response.expect("an answer body"))
}

/// The services the server lists.
async fn services(channel: Channel) -> Result<Vec<String>, tonic::Status> {
    use v1::server_reflection_request::MessageRequest;
    use v1::server_reflection_response::MessageResponse;
    match ask_v1(channel, MessageRequest::ListServices(String::new())).await? {
        MessageResponse::ListServicesResponse(list) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("not a service list: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_locks_service_and_describes_its_methods() {
    use v1::server_reflection_request::MessageRequest;
    use v1::server_reflection_response::MessageResponse;

    let s = TestServer::start().await;
    let listed = services(channel(&s).await).await.expect("ListServices");
    assert!(
        listed.contains(&"fencelock.v1.Locks".to_owned()),
        "{listed:?}"
    );

    let answer = ask_v1(
        channel(&s).await,
        MessageRequest::FileContainingSymbol("fencelock.v1.Locks".into()),
    )
    .await
    .expect("FileContainingSymbol");
    let MessageResponse::FileDescriptorResponse(files) = answer else {
        panic!("not a file descriptor: {answer:?}");
    };
    let files: Vec<prost_types::FileDescriptorProto> = files
        .file_descriptor_proto
        .iter()
        .map(|bytes| prost_types::FileDescriptorProto::decode(&bytes[..]).expect("a descriptor"))
        .collect();
    let locks = files
        .iter()
        .flat_map(|f| &f.service)
        .find(|s| s.name() == "Locks")
        .expect("the Locks service is described");
    let methods: Vec<&str> = locks.method.iter().map(|m| m.name()).collect();
    for method in ["Acquire", "Renew", "Release", "Watch"] {
        assert!(methods.contains(&method), "{methods:?}");
    }

    // A symbol that does not exist is NOT_FOUND, not a server fault.
    let unknown = ask_v1(
        channel(&s).await,
        MessageRequest::FileContainingSymbol("fencelock.v1.Nothing".into()),
    )
    .await
    .expect_err("no such symbol");
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");

    // v1alpha, which older tools ask first.
    let mut alpha =
        v1alpha::server_reflection_client::ServerReflectionClient::new(channel(&s).await);
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let answer = alpha
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("v1alpha answers")
        .into_inner()
        .message()
        .await
        .expect("one answer")
        .and_then(|a| a.message_response);
    match answer {
        Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(l)) => {
            assert!(l.service.iter().any(|s| s.name == "fencelock.v1.Locks"));
        }
        other => panic!("not a service list: {other:?}"),
    }
    s.stop().await;
}

/// With tokens configured, reflection needs none (it shows only the API's shape),
/// while the API itself still refuses a call without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_is_open_while_the_api_needs_a_token() {
    let s = TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![TokenConfig {
                name: "root".into(),
                role: Role::Admin,
                prefixes: vec![String::new()],
                sha256: fencelock_server::auth::hash_token("a-secret-for-reflection"),
                acquire_rate: None,
                request_rate: None,
                quotas: Default::default(),
            }],
        };
    })
    .await;
    let listed = services(channel(&s).await).await.expect("ListServices");
    assert!(
        listed.contains(&"fencelock.v1.Locks".to_owned()),
        "{listed:?}"
    );
    let mut locks = fencelock_proto::locks_client::LocksClient::new(channel(&s).await);
    let refused = locks
        .acquire(fencelock_proto::AcquireRequest {
            name: "r".into(),
            ttl_ms: Some(1000),
            ..Default::default()
        })
        .await
        .expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    s.stop().await;
}
